import sys

from automap.cli import main

sys.exit(main())
