"""``python -m fedshard_lightning``: the CLI, with a Ctrl-C during start-up answered in one line."""

import os
import sys

if __name__ == "__main__":
    if sys.argv[1:2] in (["runs"], ["cache"]):  # no config: answered without importing Lightning
        from fedshard_lightning.cli.no_config import run_no_config

        run_no_config(sys.argv[1:])
        raise SystemExit(0)
    try:
        from fedshard_lightning.cli import main
    except KeyboardInterrupt:  # torch and Lightning take seconds to import; nothing has started yet
        sys.stderr.write("interrupted during start-up; nothing was written\n")
        sys.stderr.flush()
        # Not SystemExit: an interrupt inside an import can leave the interpreter marked as killed
        # by SIGINT, and it would then exit with -2 instead of the documented 130.
        os._exit(130)
    main()
