import sys

from pyfast.cli import main

sys.exit(main())
