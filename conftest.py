"""Session-wide test settings for every test folder (tests/ and plugins/*/tests):

* no test ever reaches the Hugging Face hub (a MODEL that reads as ``org/name`` is looked up in
  the local hub cache only);
* nothing is written to the user's cache folder: the model-code readings kvspec keeps between
  runs (``KVSPEC_CACHE_DIR``) go to a temporary folder removed when the session ends. Set at
  import, before any test or CLI subprocess reads the environment.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"

_CACHE_DIR = tempfile.mkdtemp(prefix="kvspec-test-cache-")
os.environ["KVSPEC_CACHE_DIR"] = _CACHE_DIR
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
