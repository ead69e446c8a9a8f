#!/usr/bin/env python3
"""Palisade's host command line: `./manage.py serve`, `operator-password`, `operator-token`, ..."""

import os
import sys


def _take_data_dir(argv: list[str]) -> list[str]:
    """`--data-dir DIR` is accepted by every command: it must be known before settings load."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--data-dir" and i + 1 < len(argv):
            os.environ["PALISADE_DATA_DIR"] = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--data-dir="):
            os.environ["PALISADE_DATA_DIR"] = arg.split("=", 1)[1]
            i += 1
            continue
        out.append(arg)
        i += 1
    return out


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    argv = _take_data_dir(sys.argv)
    from django.core.management import execute_from_command_line

    execute_from_command_line(argv)


if __name__ == "__main__":
    main()
