"""The runtime tests' process: its heavy imports made once and kept out of every later garbage
collection (see `support.frozen_imports`)."""

import support.frozen_imports  # noqa: F401
