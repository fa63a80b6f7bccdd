import sys

from ragcache_core.cli import main

sys.exit(main())
