/*
 * A stand-in for NVIDIA's libnvidia-ml.so.1, for machines with no GPU (ours).
 *
 * It stands for the driver's NVML library as the real `nvidia-ml-py` bindings (module `pynvml`) call
 * it: the same entry points, signatures and return codes, so the bindings, and our detector through
 * them, run unchanged. What it reports comes from a state file the tests write (path in the environment
 * variable FAKE_NVML_STATE), re-read on every call, one fact per line:
 *
 *   gpus N                       N devices (indices 0..N-1)
 *   temp I CELSIUS               GPU I's temperature
 *   ecc I COUNT                  GPU I's volatile uncorrected ECC error count
 *   remap I CORR UNC PENDING FAILED   GPU I's row remapping (nvmlDeviceGetRemappedRows)
 *   lost I                       GPU I is lost: every call on it returns NVML_ERROR_GPU_IS_LOST
 *   xid SEQ I XID                a critical XID event on GPU I; an event set delivers each SEQ once, and
 *                                only those written after it was created (as the driver does)
 *   unsupported I WHAT           GPU I does not offer WHAT (temp, ecc or remap): NVML_ERROR_NOT_SUPPORTED
 *   no_driver                    nvmlInit fails with NVML_ERROR_DRIVER_NOT_LOADED
 *
 * Built by the tests: gcc -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 -o libnvidia-ml.so.1 fake_nvml.c
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define OK 0
#define ERR_UNINITIALIZED 1
#define ERR_INVALID_ARGUMENT 2
#define ERR_NOT_SUPPORTED 3
#define ERR_DRIVER_NOT_LOADED 9
#define ERR_TIMEOUT 10
#define ERR_GPU_IS_LOST 15
#define MAX_GPUS 16
#define MAX_EVENTS 256
#define XID_CRITICAL 0x8ULL

typedef struct { int index; } device_t;
typedef struct {
    unsigned long long device;
    unsigned long long type;
    unsigned long long data;
    unsigned int gpu_instance;
    unsigned int compute_instance;
} event_data_t;
typedef struct {
    unsigned long long mask[MAX_GPUS];
    long delivered[MAX_EVENTS]; /* SEQs this set has delivered */
    int n_delivered;
    long since; /* the events already there when the set was made are not its */
} event_set_t;

typedef struct {
    int gpus, no_driver;
    unsigned int temp[MAX_GPUS];
    unsigned long long ecc[MAX_GPUS];
    unsigned int remap[MAX_GPUS][4];
    int lost[MAX_GPUS];
    int no_temp[MAX_GPUS], no_ecc[MAX_GPUS], no_remap[MAX_GPUS];
    int n_events;
    long seq[MAX_EVENTS];
    int gpu[MAX_EVENTS];
    unsigned long long xid[MAX_EVENTS];
} state_t;

static device_t devices[MAX_GPUS];
static int initialized;

static void read_state(state_t *s) {
    memset(s, 0, sizeof *s);
    const char *path = getenv("FAKE_NVML_STATE");
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f) return;
    char key[32];
    while (fscanf(f, "%31s", key) == 1) {
        int i = 0;
        if (!strcmp(key, "gpus")) {
            if (fscanf(f, "%d", &s->gpus) != 1) break;
            if (s->gpus > MAX_GPUS) s->gpus = MAX_GPUS;
        } else if (!strcmp(key, "no_driver")) {
            s->no_driver = 1;
        } else if (!strcmp(key, "temp") && fscanf(f, "%d", &i) == 1 && i >= 0 && i < MAX_GPUS) {
            if (fscanf(f, "%u", &s->temp[i]) != 1) break;
        } else if (!strcmp(key, "ecc") && fscanf(f, "%d", &i) == 1 && i >= 0 && i < MAX_GPUS) {
            if (fscanf(f, "%llu", &s->ecc[i]) != 1) break;
        } else if (!strcmp(key, "remap") && fscanf(f, "%d", &i) == 1 && i >= 0 && i < MAX_GPUS) {
            unsigned int *r = s->remap[i];
            if (fscanf(f, "%u %u %u %u", &r[0], &r[1], &r[2], &r[3]) != 4) break;
        } else if (!strcmp(key, "lost") && fscanf(f, "%d", &i) == 1 && i >= 0 && i < MAX_GPUS) {
            s->lost[i] = 1;
        } else if (!strcmp(key, "unsupported") && fscanf(f, "%d", &i) == 1 && i >= 0 && i < MAX_GPUS) {
            char what[16];
            if (fscanf(f, "%15s", what) != 1) break;
            if (!strcmp(what, "temp")) s->no_temp[i] = 1;
            if (!strcmp(what, "ecc")) s->no_ecc[i] = 1;
            if (!strcmp(what, "remap")) s->no_remap[i] = 1;
        } else if (!strcmp(key, "xid") && s->n_events < MAX_EVENTS) {
            int k = s->n_events;
            if (fscanf(f, "%ld %d %llu", &s->seq[k], &s->gpu[k], &s->xid[k]) != 3) break;
            if (s->gpu[k] >= 0 && s->gpu[k] < MAX_GPUS) s->n_events++;
        } else {
            int c; /* an unknown line: skip it */
            while ((c = fgetc(f)) != EOF && c != '\n') {}
        }
    }
    fclose(f);
}

/* The device a handle names, checked against the state: its index, or a negative NVML error. */
static int device_of(void *handle, state_t *s) {
    if (!initialized) return -ERR_UNINITIALIZED;
    read_state(s);
    device_t *d = (device_t *)handle;
    if (d < devices || d >= devices + MAX_GPUS || d->index >= s->gpus) return -ERR_INVALID_ARGUMENT;
    if (s->lost[d->index]) return -ERR_GPU_IS_LOST;
    return d->index;
}

int nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    state_t s;
    read_state(&s);
    if (s.no_driver) return ERR_DRIVER_NOT_LOADED;
    for (int i = 0; i < MAX_GPUS; i++) devices[i].index = i;
    initialized = 1;
    return OK;
}

int nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

int nvmlShutdown(void) {
    initialized = 0;
    return OK;
}

const char *nvmlErrorString(int result) {
    switch (result) {
        case OK: return "Success";
        case ERR_UNINITIALIZED: return "Uninitialized";
        case ERR_INVALID_ARGUMENT: return "Invalid Argument";
        case ERR_NOT_SUPPORTED: return "Not Supported";
        case ERR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
        case ERR_TIMEOUT: return "Timeout";
        case ERR_GPU_IS_LOST: return "GPU is lost";
        default: return "Unknown Error";
    }
}

int nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialized) return ERR_UNINITIALIZED;
    state_t s;
    read_state(&s);
    *count = (unsigned int)s.gpus;
    return OK;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device) {
    if (!initialized) return ERR_UNINITIALIZED;
    state_t s;
    read_state(&s);
    if (index >= (unsigned int)s.gpus) return ERR_INVALID_ARGUMENT;
    if (s.lost[index]) return ERR_GPU_IS_LOST;
    *device = &devices[index];
    return OK;
}

int nvmlDeviceGetTemperature(void *device, int sensor, unsigned int *temp) {
    state_t s;
    int i = device_of(device, &s);
    if (i < 0) return -i;
    if (sensor != 0 || s.no_temp[i]) return ERR_NOT_SUPPORTED;
    *temp = s.temp[i];
    return OK;
}

int nvmlDeviceGetTotalEccErrors(void *device, int error_type, int counter_type, unsigned long long *count) {
    state_t s;
    int i = device_of(device, &s);
    if (i < 0) return -i;
    if (error_type != 1 || counter_type != 0 || s.no_ecc[i]) return ERR_NOT_SUPPORTED; /* uncorrected, volatile */
    *count = s.ecc[i];
    return OK;
}

int nvmlDeviceGetRemappedRows(void *device, unsigned int *corr, unsigned int *unc, unsigned int *pending,
                              unsigned int *failed) {
    state_t s;
    int i = device_of(device, &s);
    if (i < 0) return -i;
    if (s.no_remap[i]) return ERR_NOT_SUPPORTED;
    *corr = s.remap[i][0];
    *unc = s.remap[i][1];
    *pending = s.remap[i][2];
    *failed = s.remap[i][3];
    return OK;
}

int nvmlEventSetCreate(void **set) {
    if (!initialized) return ERR_UNINITIALIZED;
    event_set_t *es = calloc(1, sizeof(event_set_t));
    if (!es) return ERR_INVALID_ARGUMENT;
    state_t s;
    read_state(&s);
    es->since = -1;
    for (int k = 0; k < s.n_events; k++)
        if (s.seq[k] > es->since) es->since = s.seq[k];
    *set = es;
    return OK;
}

int nvmlDeviceRegisterEvents(void *device, unsigned long long types, void *set) {
    state_t s;
    int i = device_of(device, &s);
    if (i < 0) return -i;
    if (!set) return ERR_INVALID_ARGUMENT;
    if (types & ~XID_CRITICAL) return ERR_NOT_SUPPORTED;
    ((event_set_t *)set)->mask[i] |= types;
    return OK;
}

static int delivered(event_set_t *es, long seq) {
    for (int k = 0; k < es->n_delivered; k++)
        if (es->delivered[k] == seq) return 1;
    return 0;
}

int nvmlEventSetWait_v2(void *set, event_data_t *data, unsigned int timeout_ms) {
    if (!initialized) return ERR_UNINITIALIZED;
    event_set_t *es = (event_set_t *)set;
    if (!es || !data) return ERR_INVALID_ARGUMENT;
    struct timespec tick = {0, 10 * 1000 * 1000};
    for (unsigned int waited = 0;; waited += 10) {
        state_t s;
        read_state(&s);
        for (int k = 0; k < s.n_events; k++) {
            int g = s.gpu[k];
            if (!(es->mask[g] & XID_CRITICAL) || s.seq[k] <= es->since || delivered(es, s.seq[k])) continue;
            if (es->n_delivered < MAX_EVENTS) es->delivered[es->n_delivered++] = s.seq[k];
            memset(data, 0, sizeof *data);
            data->device = (unsigned long long)(size_t)&devices[g];
            data->type = XID_CRITICAL;
            data->data = s.xid[k];
            return OK;
        }
        if (waited >= timeout_ms) return ERR_TIMEOUT;
        nanosleep(&tick, NULL);
    }
}

int nvmlEventSetFree(void *set) {
    free(set);
    return OK;
}
