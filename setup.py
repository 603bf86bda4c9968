# Kept so that `pip install -e .` also works with pips older than 21.3 (no PEP 660 editable installs from
# pyproject.toml alone) and with tools that call setup.py; all metadata lives in pyproject.toml.
from setuptools import setup

setup()
