/* A layer's recorded kernel launches in one call: ``deft.ops.triton._driver_launch``.
 *
 * ``launch.py`` keeps, per recorded call, each launch's CUlaunchConfig, CUfunction and
 * parameter-pointer array in memory it owns, and the five addresses a call rebinds (q, K, V,
 * o, lse) in one uint64 array the parameters point into. Launching them from Python costs a
 * ctypes call and a few attribute writes per launch; here one call writes the addresses and
 * the stream and calls ``cuLaunchKernelEx`` (whose address the caller passes, so this file
 * needs neither the CUDA headers nor the driver library) for each launch in turn.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {          /* CUlaunchConfig (cuda.h): only the stream is written here */
    unsigned grid[3], block[3], shared;
    void *stream;
    void *attrs;
    unsigned num_attrs;
} LaunchConfig;

typedef struct {          /* one recorded launch, as launch.py lays it out */
    LaunchConfig *config;
    void *function;
    void **params;
} Entry;

typedef int (*LaunchFn)(LaunchConfig *, void *, void **, void **);

/* launch_all(launch_fn, entries, count, inputs, stream, q, k, v, o, lse) -> launches done */
static PyObject *launch_all(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "launch_all: expected 10 integer arguments");
        return NULL;
    }
    uint64_t v[10];
    for (int i = 0; i < 10; i++) {
        v[i] = PyLong_AsUnsignedLongLong(args[i]);
        if (v[i] == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    }
    LaunchFn launch = (LaunchFn)(uintptr_t)v[0];
    Entry *entries = (Entry *)(uintptr_t)v[1];
    uint64_t count = v[2], *inputs = (uint64_t *)(uintptr_t)v[3];
    void *stream = (void *)(uintptr_t)v[4];
    if (!launch || !entries || !inputs) {
        PyErr_SetString(PyExc_ValueError, "launch_all: null launch function, entries or inputs");
        return NULL;
    }
    for (int i = 0; i < 5; i++) inputs[i] = v[5 + i];
    uint64_t done = 0;
    for (; done < count; done++) {
        entries[done].config->stream = stream;
        if (launch(entries[done].config, entries[done].function, entries[done].params, NULL) != 0)
            break;
    }
    return PyLong_FromUnsignedLongLong(done);
}

static PyMethodDef methods[] = {
    {"launch_all", (PyCFunction)(void (*)(void))launch_all, METH_FASTCALL,
     "launch_all(launch_fn, entries, count, inputs, stream, q, k, v, o, lse) -> int"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_driver_launch",
                                    "A layer's recorded kernel launches in one call.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__driver_launch(void) { return PyModule_Create(&module); }
