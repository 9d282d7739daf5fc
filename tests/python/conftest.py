import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "cuda" in item.nodeid:
            item.add_marker(pytest.mark.cuda)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU and a CUDA build of flashmonoid")


def require_supported(q, k, **options):
    """Skip (with the library's reason) what this build or device does not run: the same
    supports() table the dispatcher uses."""
    import flashmonoid

    ok, reason = flashmonoid.supports(q, k, **options)
    if not ok:
        pytest.skip(f"not supported here: {reason}")
