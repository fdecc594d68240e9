"""MLflow "models from code" entry: MLflow copies this file into the logged model and runs it at load time, so the
registry holds no pickled Python object (loading a model never unpickles code)."""

import mlflow.models

from pipelines.serving.pyfunc import AwarenessPyfunc

mlflow.models.set_model(AwarenessPyfunc())
