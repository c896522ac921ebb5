from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ResetRequest(_message.Message):
    __slots__ = ("prompt", "answer", "metadata_json", "index")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    answer: str
    metadata_json: str
    index: int
    def __init__(self, prompt: _Optional[str] = ..., answer: _Optional[str] = ..., metadata_json: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("episode_id", "observation")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    observation: str
    def __init__(self, episode_id: _Optional[str] = ..., observation: _Optional[str] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("episode_id", "action")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    action: str
    def __init__(self, episode_id: _Optional[str] = ..., action: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("observation", "reward", "done")
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    observation: str
    reward: float
    done: bool
    def __init__(self, observation: _Optional[str] = ..., reward: _Optional[float] = ..., done: _Optional[bool] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("prompt", "completion", "answer", "metadata_json")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    completion: str
    answer: str
    metadata_json: str
    def __init__(self, prompt: _Optional[str] = ..., completion: _Optional[str] = ..., answer: _Optional[str] = ..., metadata_json: _Optional[str] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("reward",)
    REWARD_FIELD_NUMBER: _ClassVar[int]
    reward: float
    def __init__(self, reward: _Optional[float] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("episode_id",)
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    def __init__(self, episode_id: _Optional[str] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
