"""Worker that stays alive (the scripted collaborator in the test declares it unhealthy)."""

import time

time.sleep(600)
