"""Every test under tests/lab/ carries the `lab` mark: `python3 -m pytest
-m "not lab and not gpu"` runs the product's tests alone, and the default
run (CI's) keeps the lab's."""

import pathlib

import pytest

_LAB = pathlib.Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before -m deselects by mark
def pytest_collection_modifyitems(items):
  for item in items:
    if _LAB in pathlib.Path(item.path).parents:
      item.add_marker(pytest.mark.lab)
