"""What an operator sees: Prometheus metrics (``metrics.py``) and readable or JSON logs (``logs.py``)."""
