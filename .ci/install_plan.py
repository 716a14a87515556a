"""Turn `pip install --dry-run --report` output into "name url" lines, one wheel per line.

.ci/xla installs the lines one at a time with --no-deps so that only one downloaded wheel
sits on the disk beside the venv (see the comment there). Stdlib only: it runs in the fresh
venv before anything is installed into it.
"""

import json
import sys


def plan_lines(report: dict) -> list[str]:
    """One "name url" line per distribution pip would install, in pip's order."""
    return [
        f"{item['metadata']['name']} {item['download_info']['url']}"
        for item in report.get("install", [])
    ]


def main(argv: list[str]) -> int:
    with open(argv[1], encoding="utf-8") as report_file:
        report = json.load(report_file)
    for line in plan_lines(report):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
