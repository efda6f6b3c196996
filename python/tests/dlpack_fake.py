"""A DLPack capsule that claims another device, over a host buffer: lets the tests check that a
call refuses memory of the wrong device by argument name without a GPU. The library never
touches the memory of a refused array, so the host buffer is never read as device memory."""

import ctypes

import numpy as np


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))),
]

_KEEP = []  # the structs and buffers stay alive for the test session
_CODES = {"i": 0, "u": 1, "f": 2}
_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def on_device(arr: np.ndarray, device_type: int = 2, device_id: int = 0):
    """A DLPack capsule describing `arr` (C-contiguous) as memory of device_type (2 = CUDA)."""
    arr = np.ascontiguousarray(arr)
    shape = (ctypes.c_int64 * arr.ndim)(*arr.shape)
    m = DLManagedTensor()
    m.dl_tensor.data = arr.ctypes.data
    m.dl_tensor.device = DLDevice(device_type, device_id)
    m.dl_tensor.ndim = arr.ndim
    m.dl_tensor.dtype = DLDataType(_CODES[arr.dtype.kind], arr.dtype.itemsize * 8, 1)
    m.dl_tensor.shape = shape
    m.dl_tensor.strides = None
    m.dl_tensor.byte_offset = 0
    m.deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))(0)
    _KEEP.append((arr, shape, m))
    return _PyCapsule_New(ctypes.addressof(m), b"dltensor", None)
