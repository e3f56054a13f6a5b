"""The OpenAI Files + Batches API, self-hosted (`nightshift serve`).

    schemas.py   the wire objects (File, Batch, lists, errors) as pydantic models, OpenAI's field names and shapes
    settings.py  the server's config (limits, auth, the job template every batch runs with), checked before start
    store.py     files and batches in SQLite under the data dir (schema versioned, migrated on open)
    auth.py      API keys (file or environment), the owner each key maps to, and the label that names it in config
    quotas.py    each key's limits (stored bytes, files, unfinished batches) checked against what it holds
    scheduling.py  the order keys share the engines in: who gets a free slot, whose turn is over
    uploads.py   multipart uploads parsed while they stream in, the size limit enforced on the way
    runner.py    batches as jobs of the runtime: one `nightshift run`/`resume` process each, watched for counts,
                 cancelled by signal, resumed after a restart
    outputs.py   a batch's output and error files, streamed from its shards (or its checkpoint, if cut short)
    accounting.py a batch's `usage` and `model`, from its manifest (or its checkpoint, if cut short)
    expiry.py    `expires_after` / `output_expires_after`: OpenAI's policies and bounds, read from a request
    linecheck.py an input's lines checked by the server: JSONL at upload, the job's validator before a batch runs
                 (limits.line_errors fail_batch)
    retention.py the sweeper: expired files deleted, the bytes of deleted files and finished batches freed
    service.py   `BatchService`: the store, runner, sweeper and keys one server's requests act on
    routes.py    the FastAPI app, assembled: the service in app.state, the routers, the error handlers
    api/         one router per resource (files, batches, metrics, health), the dependencies they are given
                 (the service, the caller's owner) and OpenAI's errors and status codes
    health.py    the checks of /healthz (liveness) and /readyz (the database takes a write, Ray answers)
    exposure.py  where Serve really listens: no keys (auth.disabled) only while that is loopback
    app.py       the Ray Serve deployment wrapping that app, and the application import path for KubeRay

Imports point downward: the server uses the runtime (through the `nightshift` CLI in a child process and the staging
area's reader); nothing under pipeline/runtime knows this package exists.
"""
