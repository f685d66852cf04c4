import sys

from deepinfer.cli.main import main

sys.exit(main())
