#!/usr/bin/env python3
"""Stands in for espeak-ng and flite on a lent GPU machine, which has neither (nor their
libraries): their outputs are recorded here, keyed on the command line without its output
path, and replayed there. Only the standard library: it runs under any python3.

    record: PATH=scripts/device/tts:$PATH VOXTIDE_TTS_REAL=/usr/bin VOXTIDE_TTS_CACHE=DIR CMD
    replay: PATH=scripts/device/tts:$PATH VOXTIDE_TTS_CACHE=DIR CMD
"""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

OUTPUT_FLAG = {"espeak-ng": "-w", "flite": "-o"}


def main() -> None:
    tool, args = sys.argv[1], sys.argv[2:]
    at = args.index(OUTPUT_FLAG[tool])
    out = args[at + 1]
    key = hashlib.sha256("\0".join([tool, *args[:at], *args[at + 2:]]).encode()).hexdigest()
    cache = Path(os.environ["VOXTIDE_TTS_CACHE"])
    cached = cache / f"{key}.wav"
    real = os.environ.get("VOXTIDE_TTS_REAL")
    if real:
        subprocess.run([str(Path(real) / tool), *args], check=True)
        cache.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out, cached)
    elif cached.exists():
        shutil.copyfile(cached, out)
    else:
        sys.exit(f"{tool}: not recorded: {' '.join(args)}")


if __name__ == "__main__":
    main()
