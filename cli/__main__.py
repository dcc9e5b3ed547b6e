import sys

from rollout_queue.cli.command import main

if __name__ == "__main__":
    sys.exit(main())
