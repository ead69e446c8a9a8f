"""The flow sums: their ladder of spans (ladder.py), their writes (writes.py) and their read plan
(reads.py)."""
