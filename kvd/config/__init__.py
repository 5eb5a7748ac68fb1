"""Settings, pure: defaults < TOML file < ``KVD_*`` environment < command-line flags (``settings``), and the
parsers of sizes, durations and ranges they use (``parsers``). Shared by the command line and the cluster."""

from kvd.config.settings import *  # noqa: F403
from kvd.config.settings import __all__  # noqa: F401
