"""RL routes (SGLang's names and fields, issue 16): weights pushed into the running engine.

    GET  /get_weight_version                -> {"weight_version"}
    POST /update_weights_from_disk          {model_path, weight_version?, flush_cache=true, abort_all_requests=false}
    POST /update_weights_from_tensor        {shm_path, tensors: [{name, dtype, shape, offset}], weight_version?,
                                             flush_cache=true, abort_all_requests=false}
    POST /init_weights_update_group         {master_address, master_port, rank_offset, world_size,
                                             group_name="weights_update_group", backend="gloo", timeout_s=300}
    POST /update_weights_from_distributed   {names, dtypes, shapes, group_name, weight_version?, flush_cache,
                                             abort_all_requests}
    POST /destroy_weights_update_group      {group_name}
    POST /pause_generation                  {mode: abort|retract|in_place} -> {"success", "num_requests"}
    POST /continue_generation               {}
    POST /release_memory_occupation         {tags?: [kv_cache, weights]} -> {"success", "released", "bytes"}
    POST /resume_memory_occupation          {tags?} (weights come back as zeros: push them again)

An update answers ``{"success": true, "message", "weight_version", "num_tensors", "flushed_cache",
"num_aborted_requests", "seconds"}`` once written (between two engine steps; with flush_cache after the
requests already in the engine finished, or were aborted). A refused update (unreadable path, a
missing, unknown or misshapen tensor, a non-float dtype, a broken broadcast) is a 400 OpenAI error
object with code ``invalid_weight_update``, and the old weights keep serving.

The tensor route takes a shared-memory handle (``idleless.rl.shm.SharedTensors.payload()``), never
weights over the socket; SGLang's ``serialized_named_tensors`` (pickled handles) is refused, since
unpickling a client's bytes runs the client's code.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from idleless.engine.messages import (ContinueGeneration, DestroyWeightsUpdateGroup, GetWeightVersion,
                                      InitWeightsUpdateGroup, PauseGeneration, ReleaseMemoryOccupation,
                                      ResumeMemoryOccupation, UpdateWeightsFromDisk,
                                      UpdateWeightsFromDistributed, UpdateWeightsFromTensor)
from idleless.server.context import ServerContext, engine_unavailable
from idleless.server.engine_client import CallFailed, CallRefused, EngineDeadError
from idleless.server.protocol import APIError, parse_request

# An update waits for the requests already in the engine to finish (or a trainer to join): long calls.
UPDATE_TIMEOUT_S = 3600.0
GROUP = "weights_update_group"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _UpdateOptions(_Body):
    weight_version: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class UpdateFromDiskRequest(_UpdateOptions):
    model_path: str = Field(min_length=1)
    load_format: Optional[str] = None  # SGLang's; only the default (auto) is served


class TensorEntry(_Body):
    name: str = Field(min_length=1)
    dtype: str
    shape: list[int]
    offset: int = Field(ge=0)


class UpdateFromTensorRequest(_UpdateOptions):
    shm_path: Optional[str] = None
    tensors: Optional[list[TensorEntry]] = None
    serialized_named_tensors: Optional[list[Any]] = None  # SGLang's pickled form: refused with a reason
    load_format: Optional[str] = None


class InitGroupRequest(_Body):
    master_address: str = Field(min_length=1)
    master_port: int = Field(gt=0, lt=65536)
    rank_offset: int = Field(ge=0)
    world_size: int = Field(ge=2)
    group_name: str = GROUP
    backend: str = "gloo"
    timeout_s: float = Field(default=300.0, gt=0)


class UpdateFromDistributedRequest(_UpdateOptions):
    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = GROUP


class DestroyGroupRequest(_Body):
    group_name: str = GROUP


class PauseRequest(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class MemoryRequest(_Body):
    tags: Optional[list[Literal["kv_cache", "weights"]]] = None  # None: both


def register(app: FastAPI, ctx: ServerContext) -> None:
    """Add the RL routes to ``app``."""
    client = ctx.client

    async def call(verb, timeout: float = UPDATE_TIMEOUT_S, param: Optional[str] = None,
                   code: str = "invalid_weight_update"):
        try:
            result = await client.call(verb, timeout=timeout)
            if isinstance(result, dict) and result.get("flushed_cache"):
                client.forget_pins()  # the flush took the pins with it
            return result
        except CallRefused as e:
            raise APIError(400, str(e), param=param, code=code) from None
        except CallFailed as e:
            raise APIError(500, f"the weight update failed in the engine: {e}", code="internal_error") from None
        except EngineDeadError as e:
            raise engine_unavailable(e) from None
        except asyncio.TimeoutError:
            raise APIError(503, f"the engine did not answer within {timeout:.0f} s", code="engine_unavailable",
                           headers={"Retry-After": "5"}) from None

    def check_load_format(fmt: Optional[str]) -> None:
        if fmt not in (None, "auto"):
            raise APIError(400, f"load_format {fmt!r} is not supported (only the default)", param="load_format",
                           code="invalid_value")

    @app.get("/get_weight_version")
    async def get_weight_version():
        return JSONResponse({"weight_version": await call(GetWeightVersion(), timeout=30.0)})

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        req = parse_request(UpdateFromDiskRequest, await ctx.read_json(request))
        check_load_format(req.load_format)
        verb = UpdateWeightsFromDisk(req.model_path, req.weight_version, req.flush_cache, req.abort_all_requests)
        return JSONResponse(await call(verb, param="model_path"))

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        req = parse_request(UpdateFromTensorRequest, await ctx.read_json(request))
        check_load_format(req.load_format)
        if req.serialized_named_tensors is not None:
            raise APIError(400, "serialized_named_tensors (pickled tensors) is not accepted: unpickling a "
                           "client's bytes runs its code. Send a shared-memory handle instead: {shm_path, tensors} "
                           "from idleless.rl.shm.SharedTensors.create(named_tensors).payload()",
                           param="serialized_named_tensors", code="unsupported_field")
        if req.shm_path is None or not req.tensors:
            raise APIError(400, "give shm_path and a non-empty tensors list", param="tensors", code="invalid_value")
        from idleless.rl.shm import TensorSpec
        specs = tuple(TensorSpec(t.name, t.dtype, tuple(t.shape), t.offset) for t in req.tensors)
        verb = UpdateWeightsFromTensor(req.shm_path, specs, req.weight_version, req.flush_cache,
                                       req.abort_all_requests)
        return JSONResponse(await call(verb, param="tensors"))

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        req = parse_request(InitGroupRequest, await ctx.read_json(request))
        verb = InitWeightsUpdateGroup(req.master_address, req.master_port, req.rank_offset, req.world_size,
                                      req.group_name, req.backend, req.timeout_s)
        await call(verb, timeout=req.timeout_s + 30.0)
        return JSONResponse({"success": True, "message": f"joined {req.group_name!r} as rank {req.rank_offset}"})

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        req = parse_request(UpdateFromDistributedRequest, await ctx.read_json(request))
        if not (len(req.names) == len(req.dtypes) == len(req.shapes)):
            raise APIError(400, "names, dtypes and shapes must have the same length", param="names",
                           code="invalid_value")
        verb = UpdateWeightsFromDistributed(req.names, req.dtypes, req.shapes, req.group_name, req.weight_version,
                                            req.flush_cache, req.abort_all_requests)
        return JSONResponse(await call(verb))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        req = parse_request(DestroyGroupRequest, await ctx.read_json(request))
        await call(DestroyWeightsUpdateGroup(req.group_name), timeout=30.0, param="group_name")
        return JSONResponse({"success": True, "message": f"left {req.group_name!r}"})

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        """Stop the engine's steps until /continue_generation (``PauseGeneration``'s modes); requests
        arriving meanwhile wait. ``num_requests``: requests aborted or retracted."""
        body = await request.body()
        req = parse_request(PauseRequest, (await ctx.read_json(request)) if body.strip() else {})
        n = await call(PauseGeneration(req.mode), timeout=60.0, param="mode")
        return JSONResponse({"success": True, "mode": req.mode, "num_requests": n})

    @app.post("/continue_generation")
    async def continue_generation():
        await call(ContinueGeneration(), timeout=60.0)
        return JSONResponse({"success": True})

    async def memory_call(request: Request, verb_type) -> JSONResponse:
        body = await request.body()
        req = parse_request(MemoryRequest, (await ctx.read_json(request)) if body.strip() else {})
        res = await call(verb_type(tuple(req.tags or ())), timeout=120.0, param="tags", code="invalid_request")
        return JSONResponse({"success": True, **res})

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request):
        """Free the KV cache's and/or the weights' memory for a trainer on this machine (SGLang's route);
        requests wait until every tag is resumed. 400 while requests are in the engine."""
        return await memory_call(request, ReleaseMemoryOccupation)

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request):
        """Take the memory back (zero-filled; weights must be pushed again)."""
        return await memory_call(request, ResumeMemoryOccupation)
