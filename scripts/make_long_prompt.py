#!/usr/bin/env python3
"""Write a long real chat prompt (>= 4,000 tokens of the default model) for the end-to-end
checks, from a license text that every Debian system carries (base-files). The text is read on
the machine, not shipped with the project.

usage: python scripts/make_long_prompt.py --out prompts/chat/05-long-license.json
"""

import argparse
import json
import sys
from pathlib import Path

SOURCE = Path("/usr/share/common-licenses/GPL-3")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--chars", type=int, default=22000, help="how much of the text to use")
    args = parser.parse_args()
    if not SOURCE.is_file():
        print(f"error: {SOURCE} is missing (Debian's base-files provides it)", file=sys.stderr)
        return 1
    text = SOURCE.read_text(encoding="utf-8")[: args.chars]
    request = {
        "messages": [
            {"role": "system", "content": "You answer questions about legal documents plainly."},
            {
                "role": "user",
                "content": "Here is the beginning of a software license.\n\n"
                + text
                + "\n\nIn three sentences: what does this license say about distributing "
                "modified versions of the program?",
            },
        ]
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(request), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
