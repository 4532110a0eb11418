import sys

from kvbridge_operator.cli.main import main

sys.exit(main())
