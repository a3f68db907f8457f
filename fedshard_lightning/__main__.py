"""``python -m fedshard_lightning``."""

from fedshard_lightning.cli import main

if __name__ == "__main__":
    main()
