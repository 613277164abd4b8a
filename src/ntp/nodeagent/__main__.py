"""`python -m ntp.nodeagent`: the trainer image's entrypoint."""

import sys

from ntp.nodeagent.agent import main

sys.exit(main())
