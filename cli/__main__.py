import sys

from cli.command import main

if __name__ == "__main__":
    sys.exit(main())
