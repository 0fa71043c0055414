import sys

from scale_llm.cli import main

sys.exit(main())
