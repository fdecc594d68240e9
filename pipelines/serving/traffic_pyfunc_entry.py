"""MLflow "models from code" entry of the traffic VLM pyfunc: copied into the logged model and run at load time, so
the registry holds no pickled Python object."""

import mlflow.models

from pipelines.serving.traffic_pyfunc import TrafficPyfunc

mlflow.models.set_model(TrafficPyfunc())
