"""vLLM inside the replica: generation (:class:`VLLMEngine`) and embeddings
(:class:`VLLMEmbedder`), each over one vLLM ``AsyncLLM`` that the replica starts at load
(:func:`~serve_app.replica.vllm.runtime.start_vllm`).

Why vLLM's async engine inside our ModelServer, not Ray Serve LLM's ``LLMServer``
deployment behind the router: the replica stays one deployment type, so the daily
schedule, ``max_ongoing_requests``, deadlines, replica retry, ``/v1/stats`` and the
typed calls work for vLLM-backed models without a second adapter; a call crosses one
handle (router -> replica) instead of LLMServer's OpenAI request objects; and the
engine sees our call's token ids, so the context check and its 400 are the same as on
the transformers engines. What LLMServer adds, placing a tensor-parallel engine on
several GPUs, is a placement group on the replica (``serve_app.app``) and vLLM's Ray
executor, which is what LLMServer itself does.

vLLM batches continuously on its own (its scheduler owns the running batch, paged KV
cache, prefix cache and chunked prefill), so its rows skip the replica's
``@serve.batch`` admission window and executor. This package imports vLLM; the replica
imports it only for a model that runs on vLLM.
"""
