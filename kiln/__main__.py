import sys

from kiln.cli.main import main

sys.exit(main())
