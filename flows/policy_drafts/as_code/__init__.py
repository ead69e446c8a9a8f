"""Policy as code: the file's format and export (format.py), reading a file with its findings
(parse.py), its plan against the stored policy (plan.py) and its apply (apply.py)."""
