"""Stream audio files to a running Voxtide server as N concurrent sessions (= `voxtide replay`).

    scripts/dev.sh run python scripts/replay.py FILE... --sessions 8 [--fast] [--loop-seconds 7200]
"""

import sys

from app.cli import main

if __name__ == "__main__":
    sys.exit(main(["replay", *sys.argv[1:]]))
