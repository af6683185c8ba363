"""`zeroshard train`: `command` checks the options (`args`) and launches torchrun on `worker`,
one rank each; the worker builds the model (`model`), the batches (`data`), the config
(`config`), resumes (`resume`), logs resources (`resources`) and reports (`report`);
`prelaunch` holds the checks that need the settings before any rank starts."""
