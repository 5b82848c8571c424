"""The engine process: a vLLM OpenAI-compatible server with live weight updates and heartbeats.

- `server.py`: the vLLM command line, and the ASGI middleware that runs inside vLLM's API server
  process: it stamps every response with `x-rollstream-weight-version` and serves the small
  `/rollstream/*` control surface (state, join the broadcast group, receive a broadcast, load a
  staged version).
- `extension.py`: the vLLM worker extension that joins the learner's collective group, receives
  bucketed tensors and loads them, or loads a verified version directory (runs in the worker).
- `updates.py`: the staged path (download a version's shards from MinIO, verify each sha256) and
  the client of the control surface; the pure rule of which versions each pool loads.
- `heartbeat.py`: probes the server and publishes `engine_heartbeat` events to `engines`.
- `poll.py`: a vLLM general plugin, loaded in each of vLLM's processes, that makes a CPU engine's engine core
  and worker sleep between polls of the queues that join them instead of spinning on the shared cores.

Requests in flight during an update FINISH ON THE OLD WEIGHTS. An update closes a gate in front
of the OpenAI routes (new requests wait at the gate, they are not refused), waits until every
request already admitted has sent its whole response, then loads the new weights, resets the
prefix cache (its KV entries were computed by the old weights), sets the version and opens the
gate. A version therefore never changes while a request is inside the engine, and the header each
response carries is exactly the version that produced all of its tokens. Cost: an update waits
for the longest request in flight (at most `max_new_tokens` of decoding), and requests that
arrive meanwhile wait that long plus the load time; the learner's broadcast blocks for as long.
"""
