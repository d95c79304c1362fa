from tests.parallel.conftest import pool2  # noqa: F401
