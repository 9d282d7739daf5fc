import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "cuda" in item.nodeid:
            item.add_marker(pytest.mark.cuda)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU and a CUDA build of flashmonoid")
