"""``python -m fedshard_lightning``: the CLI, with a Ctrl-C during start-up answered in one line."""

import os
import sys

if __name__ == "__main__":
    try:
        from fedshard_lightning.cli import main
    except KeyboardInterrupt:  # torch and Lightning take seconds to import; nothing has started yet
        sys.stderr.write("interrupted during start-up; nothing was written\n")
        sys.stderr.flush()
        # Not SystemExit: an interrupt inside an import can leave the interpreter marked as killed
        # by SIGINT, and it would then exit with -2 instead of the documented 130.
        os._exit(130)
    main()
