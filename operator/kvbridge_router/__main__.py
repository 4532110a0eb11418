import sys

from kvbridge_router.cli import main

sys.exit(main())
