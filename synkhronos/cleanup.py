"""``python -m synkhronos.cleanup``: list and remove the shared memory of runs killed whole.

A run ended by SIGKILL together with its resource trackers (``kill -9`` of the
process group, the OOM killer, a scheduler's cancel) leaves its segments in
``/dev/shm`` until reboot. A run is alive while its master holds the lock on
the run's ``<prefix>_live`` segment, whatever PID namespace it runs in (a
container sharing ``/dev/shm`` with the host included); ``fork()`` removes
the segments of this user's runs that nobody holds, and this command does the
same without starting anything. Entries named like segments that are not
this user's segments (directories, links, fifos, other users' files) are
listed as skipped and left alone.

Examples
--------
    python -m synkhronos.cleanup            # list them and remove them
    python -m synkhronos.cleanup --dry-run  # only list them
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from .ipc.segments import SEGMENT_DIRECTORY, stale_segments


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m synkhronos.cleanup",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="list them, remove nothing")
    args = parser.parse_args(argv)
    found = stale_segments(remove=not args.dry_run)
    for name in found.stale:
        print(name)
    for name, why in found.skipped:
        print(f"skipped {name}: {why}")
    verb = "left by runs that no longer run" if args.dry_run else "removed"
    print(f"{len(found.stale)} segment(s) {verb}"
          + (f", {sum(map(_size, found.stale)) / 2**20:.1f} MiB" if args.dry_run else "")
          + (f"; {len(found.skipped)} entr{'y' if len(found.skipped) == 1 else 'ies'} skipped, "
             f"not this user's segments" if found.skipped else ""))
    return 0


def _size(name: str) -> int:
    try:
        return os.lstat(os.path.join(SEGMENT_DIRECTORY, name)).st_size
    except OSError:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
