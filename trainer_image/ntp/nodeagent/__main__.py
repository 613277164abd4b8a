"""`python -m ntp.nodeagent`: the trainer image's entrypoint."""

import sys

from ntp.nodeagent.main import main

sys.exit(main())
