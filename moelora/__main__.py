import sys

from moelora.cli import main

sys.exit(main())
