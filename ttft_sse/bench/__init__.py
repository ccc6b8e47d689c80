"""``ttft-sse bench``: measure time to first token, inter-token latency and throughput of a streaming server.

    cli.py        the command's arguments and the run that ties the phases together
    prompts.py    the default prompt set (``prompts.jsonl``, shipped) and user prompt files
    protocol.py   what to send and how to read replies: native (/stream, /complete) and openai (/v1/chat/completions)
    client.py     one measured request (httpx): times, tokens and its outcome
    load.py       the load phase: every target, mode and concurrency level, alternating between arms
    typist.py     --typing-cps: the last message typed, with /prefill called as the chat page calls it
    coldstart.py  starting the server N times: time to ready, its stage breakdown, first vs steady TTFT
    soak.py       sequential requests with the server's RSS read at intervals
    stats.py      percentiles and summaries (pure)
    report.py     the results document (JSON), the terminal table, the comparisons
    charts.py     PNG charts from the results document (matplotlib, the ``bench`` extra)

It is a client: it never imports the server, torch or transformers.
"""
