import sys

from hanzo_gym.cli import main

sys.exit(main())
