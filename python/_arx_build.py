"""The arx module's PEP 517 build backend: maturin's, with one choice added.

CPython 3.11 and later get the stable-ABI build (the crate's default
feature ``abi3``): one wheel for all of them. The buffer protocol, through
which arx reads host arrays, joined the stable ABI only in 3.11, so on
CPython 3.10 (Ubuntu 22.04's python3) this asks maturin for a build for the
running interpreter instead (``--no-default-features``). Build arguments
given through ``--config-settings`` replace ``MATURIN_PEP517_ARGS`` and
with it this choice: give ``--no-default-features`` there too on 3.10.
"""

import os
import sys

from maturin import *  # noqa: F401,F403  (maturin's PEP 517 hooks)

if sys.version_info < (3, 11):
    _args = os.environ.get("MATURIN_PEP517_ARGS", "")
    if "--no-default-features" not in _args.split():
        os.environ["MATURIN_PEP517_ARGS"] = (_args + " --no-default-features").strip()
