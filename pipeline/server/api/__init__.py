"""The HTTP API's routes, one router per resource; server/routes.py assembles them into the app.

deps.py     what handlers are given by dependency: the service (app.state), the caller's owner (401 without a
            known key), a page's limit and its list object
errors.py   `ApiError` and the exception handlers that answer every error in OpenAI's body and status
files.py    /v1/files: upload (streamed, checked line by line), list, get, content, delete
batches.py  /v1/batches: create, get, list, cancel
metrics.py  /metrics: the caller's batches, jobs and stored bytes for Prometheus
health.py   /healthz and /readyz, without a key (the checks are server/health.py's)
"""
