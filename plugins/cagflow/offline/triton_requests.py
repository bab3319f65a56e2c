"""One request to a CAGFlow model on Triton, for the steps that precompute there or ask serving to reload.
``tritonclient`` is imported only when a request is made, so workers without it can run the other steps."""

from __future__ import annotations

import numpy as np

from ..config import Config


def triton_call(config: Config, model: str, timeout_s: float, **values: str | bool) -> dict[str, str]:
    """One request to a CAGFlow model on Triton (every input a ``[1, 1]`` tensor); its text outputs.

    Raises ``OSError`` when Triton cannot be reached and ``InferenceServerException`` when it refuses.
    """
    import tritonclient.http as httpclient

    inputs = []
    for name, value in values.items():
        datatype, array = (("BOOL", np.array([[value]], dtype=bool)) if isinstance(value, bool) else
                           ("BYTES", np.array([[value.encode()]], dtype=np.object_)))
        tensor = httpclient.InferInput(name, [1, 1], datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client = httpclient.InferenceServerClient(config.precompute.triton_url, connection_timeout=timeout_s,
                                              network_timeout=timeout_s)
    try:
        result = client.infer(model, inputs)
        names = [output["name"] for output in result.get_response()["outputs"]]
        return {name: result.as_numpy(name).reshape(-1)[0].decode() for name in names
                if result.as_numpy(name).dtype == np.object_}
    finally:
        client.close()
