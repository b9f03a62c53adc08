"""Choosing a backend: probe a device (``health``, ``probe``, ``isolate``), prove and time candidates (``verify``,
``tuner``, ``timer``), remember on disk (``cache``, ``records``, ``fingerprint``), and the ``Dispatcher`` that ties
them together; ``guard`` watches outputs in guard mode, ``report`` prints a device's standing."""
