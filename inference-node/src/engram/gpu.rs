//! Fusion on the GPU (feature `cuda`): the CUDA driver and NVRTC are loaded
//! at run time through cudarc, and the three kernels below are compiled by
//! NVRTC when the backend starts, so the build needs no CUDA toolkit.
//!
//! Per call (up to [`CHUNK`] positions at a time): rows land in a pinned,
//! write-combined host buffer ([`GpuFusion::staging_rows`] lets a fetch
//! write them there directly), are copied to the device, dequantized to
//! bf16 there (`engram_dequant`, flagging corrupt rows), multiplied by `wkv`
//! (`engram_matvec`, f32 accumulation, one warp per output value) and gated
//! into the hidden state (`engram_gates`, f64 sums like the CPU path).
//!
//! cudarc's loader panics when a library is missing, so [`probe`] checks
//! that libcuda and libnvrtc can be opened before anything touches them,
//! and backend creation also runs under `catch_unwind`: a machine without
//! a driver gets an error, never a panic.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use engram_protocol::hashing::COLUMNS;
use engram_protocol::row::RowError;

use super::fusion::{Fusion, FusionError, POSITION_ROW_BYTES, check_inputs};
use super::weights::{ENGRAM_DIM, FusionShape, FusionWeights};

/// Positions per device pass (bounds the staging and device buffers).
pub const CHUNK: usize = 256;

const KERNELS: &str = r#"
#define DIM 6144
#define COLS 24

extern "C" __global__ void engram_dequant(const unsigned char* rows, const unsigned int* live,
                                          unsigned int n_live, unsigned short* e,
                                          unsigned int* bad) {
    unsigned int i = blockIdx.x / COLS, c = blockIdx.x % COLS, t = threadIdx.x;
    if (i >= n_live) return;
    unsigned int p = live[i];
    const unsigned char* row = rows + ((size_t)p * COLS + c) * 264;
    unsigned char code = row[t];
    unsigned char sc = row[256 + t / 32];
    if ((code & 0x7f) == 0x7f || sc == 0xff) {
        atomicMin(bad, p * COLS + c);
        return;
    }
    unsigned int ex = (code >> 3) & 0xf, m = code & 7;
    float v = ex == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), (int)ex - 10);
    v = ldexpf(v, (int)sc - 127);
    if (code & 0x80) v = -v;
    unsigned int bits = __float_as_uint(v);
    bits += 0x7fff + ((bits >> 16) & 1);
    e[(size_t)i * DIM + c * 256 + t] = (unsigned short)(bits >> 16);
}

extern "C" __global__ void engram_matvec(const float* wkv, const unsigned short* e, float* kv,
                                         unsigned int kv_len) {
    __shared__ float es[DIM];
    unsigned int i = blockIdx.y;
    const unsigned short* ei = e + (size_t)i * DIM;
    for (unsigned int j = threadIdx.x; j < DIM; j += blockDim.x)
        es[j] = __uint_as_float(((unsigned int)ei[j]) << 16);
    __syncthreads();
    unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    unsigned int r = blockIdx.x * (blockDim.x / 32) + warp;
    if (r >= kv_len) return;
    const float* wr = wkv + (size_t)r * DIM;
    float acc = 0.f;
    for (unsigned int j = lane; j < DIM; j += 32) acc += wr[j] * es[j];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    if (lane == 0) kv[(size_t)i * kv_len + r] = acc;
}

extern "C" __global__ void engram_gates(float* h, const float* w, const float* kv,
                                        const unsigned int* live, unsigned int hidden,
                                        unsigned int streams) {
    __shared__ double sa[256], sb[256], sc[256];
    __shared__ float g;
    unsigned int s = blockIdx.x, i = blockIdx.y, t = threadIdx.x;
    unsigned int p = live[i];
    size_t kv_len = (size_t)(streams + 1) * hidden;
    float* hs = h + ((size_t)p * streams + s) * hidden;
    const float* key = kv + (size_t)i * kv_len + (size_t)s * hidden;
    const float* value = kv + (size_t)i * kv_len + (size_t)streams * hidden;
    const float* ws = w + (size_t)s * hidden;
    double a = 0.0, b = 0.0, c = 0.0;
    for (unsigned int d = t; d < hidden; d += blockDim.x) {
        double x = hs[d], k = key[d];
        a += x * (double)ws[d] * k;
        b += x * x;
        c += k * k;
    }
    sa[t] = a; sb[t] = b; sc[t] = c;
    __syncthreads();
    for (unsigned int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (t < o) { sa[t] += sa[t + o]; sb[t] += sb[t + o]; sc[t] += sc[t + o]; }
        __syncthreads();
    }
    if (t == 0) {
        double n = (double)hidden;
        double dot = sa[0] / sqrt(sb[0] / n + 1e-20) / sqrt(sc[0] / n + 1e-20) / sqrt(n);
        double mag = sqrt(fmax(fabs(dot), 1e-6));
        double x = dot > 0.0 ? mag : (dot < 0.0 ? -mag : dot * 0.0);
        g = (float)(1.0 / (1.0 + exp(-x)));
    }
    __syncthreads();
    for (unsigned int d = t; d < hidden; d += blockDim.x) hs[d] = __fadd_rn(hs[d], __fmul_rn(g, value[d]));
}
"#;

fn gpu_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> FusionError + '_ {
    move |e| FusionError::Gpu(format!("{what}: {e}"))
}

/// Check that the CUDA driver library and NVRTC can be loaded, without
/// touching cudarc's loaders (which panic when a library is missing).
pub fn probe() -> Result<(), FusionError> {
    // SAFETY: these only try to dlopen the libraries by name and close them.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(FusionError::Gpu(
            "the CUDA driver library (libcuda.so) cannot be loaded: no NVIDIA driver here".into(),
        ));
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(FusionError::Gpu(
            "NVRTC (libnvrtc.so) cannot be loaded: install the CUDA runtime compiler \
             or put it on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    Ok(())
}

/// The GPU backend.
pub struct GpuFusion {
    shape: FusionShape,
    stream: Arc<CudaStream>,
    dequant: CudaFunction,
    matvec: CudaFunction,
    gates: CudaFunction,
    wkv: [CudaSlice<f32>; 2],
    w: [CudaSlice<f32>; 2],
    staging: PinnedHostSlice<u8>,
    host_h: PinnedHostSlice<f32>,
    live_idx: Vec<u32>,
    d_rows: CudaSlice<u8>,
    d_live: CudaSlice<u32>,
    d_e: CudaSlice<u16>,
    d_kv: CudaSlice<f32>,
    d_h: CudaSlice<f32>,
    d_bad: CudaSlice<u32>,
}

impl std::fmt::Debug for GpuFusion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuFusion")
            .field("shape", &self.shape)
            .finish_non_exhaustive()
    }
}

impl GpuFusion {
    /// Start the backend on GPU `ordinal`: load the libraries, compile the
    /// kernels, upload both layers' weights, allocate the buffers.
    pub fn new(weights: &FusionWeights, ordinal: usize) -> Result<Self, FusionError> {
        probe()?;
        catch_unwind(AssertUnwindSafe(|| Self::start(weights, ordinal))).unwrap_or_else(|p| {
            let why = p
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| p.downcast_ref::<&str>().copied())
                .unwrap_or("unknown panic");
            Err(FusionError::Gpu(format!("CUDA failed to start: {why}")))
        })
    }

    fn start(weights: &FusionWeights, ordinal: usize) -> Result<Self, FusionError> {
        let shape = weights.shape;
        let ctx = CudaContext::new(ordinal).map_err(gpu_err("opening the GPU"))?;
        let stream = ctx.new_stream().map_err(gpu_err("creating a stream"))?;
        let ptx = cudarc::nvrtc::compile_ptx(KERNELS)
            .map_err(|e| FusionError::Gpu(format!("compiling the kernels: {e}")))?;
        let module = ctx
            .load_module(ptx)
            .map_err(gpu_err("loading the kernels"))?;
        let f = |name| module.load_function(name).map_err(gpu_err(name));
        let (dequant, matvec, gates) = (
            f("engram_dequant")?,
            f("engram_matvec")?,
            f("engram_gates")?,
        );
        let up = |v: &[f32]| stream.clone_htod(v).map_err(gpu_err("uploading weights"));
        let wkv = [up(&weights.layers[0].wkv)?, up(&weights.layers[1].wkv)?];
        let w = [up(&weights.layers[0].w)?, up(&weights.layers[1].w)?];
        let alloc = gpu_err("allocating buffers");
        // SAFETY: the staging buffer is written before each copy that reads it.
        let staging =
            unsafe { ctx.alloc_pinned::<u8>(CHUNK * POSITION_ROW_BYTES) }.map_err(&alloc)?;
        // Not write-combined: the host reads the fused states back from it.
        // SAFETY: written by a device copy before the host reads it.
        let host_h = unsafe { ctx.alloc_pinned_with_flags::<f32>(CHUNK * shape.state_len(), 0) }
            .map_err(&alloc)?;
        Ok(Self {
            shape,
            dequant,
            matvec,
            gates,
            wkv,
            w,
            staging,
            host_h,
            live_idx: Vec::with_capacity(CHUNK),
            d_rows: stream
                .alloc_zeros(CHUNK * POSITION_ROW_BYTES)
                .map_err(&alloc)?,
            d_live: stream.alloc_zeros(CHUNK).map_err(&alloc)?,
            d_e: stream.alloc_zeros(CHUNK * ENGRAM_DIM).map_err(&alloc)?,
            d_kv: stream.alloc_zeros(CHUNK * shape.kv_len()).map_err(&alloc)?,
            d_h: stream
                .alloc_zeros(CHUNK * shape.state_len())
                .map_err(&alloc)?,
            d_bad: stream.alloc_zeros(1).map_err(&alloc)?,
            stream,
        })
    }

    /// The pinned buffer for the rows of `positions` (at most [`CHUNK`])
    /// positions, 24 rows each: fill it, then call [`GpuFusion::fuse_staged`].
    pub fn staging_rows(&mut self, positions: usize) -> Result<&mut [u8], FusionError> {
        if positions > CHUNK {
            return Err(FusionError::Length {
                what: "staged positions",
                positions,
                expected: CHUNK,
                got: positions,
            });
        }
        let all = self
            .staging
            .as_mut_slice()
            .map_err(gpu_err("waiting for the staging buffer"))?;
        Ok(&mut all[..positions * POSITION_ROW_BYTES])
    }

    /// Fuse `live.len()` (at most [`CHUNK`]) positions whose rows are in the staging buffer.
    pub fn fuse_staged(
        &mut self,
        layer: u32,
        live: &[bool],
        hidden: &mut [f32],
    ) -> Result<(), FusionError> {
        let n = live.len();
        if n > CHUNK {
            return Err(FusionError::Length {
                what: "staged positions",
                positions: n,
                expected: CHUNK,
                got: n,
            });
        }
        let rows_len = n * POSITION_ROW_BYTES;
        let wait = gpu_err("waiting for the staging buffer");
        // The rows are already staged; only their length is checked here.
        let li = check_inputs(
            self.shape,
            layer,
            &self.staging.as_slice().map_err(&wait)?[..rows_len],
            live,
            hidden,
        )?;
        self.live_idx.clear();
        self.live_idx
            .extend((0..n as u32).filter(|&p| live[p as usize]));
        let n_live = self.live_idx.len() as u32;
        if n_live == 0 {
            return Ok(());
        }
        // Every copy below has a destination at least as long as its source
        // (n <= CHUNK): cudarc asserts that.
        let staged = self.staging.as_slice().map_err(&wait)?;
        let s = &self.stream;
        let copy = gpu_err("copying to the GPU");
        s.memcpy_htod(&staged[..rows_len], &mut self.d_rows.slice_mut(..rows_len))
            .map_err(&copy)?;
        s.memcpy_htod(
            &self.live_idx,
            &mut self.d_live.slice_mut(..n_live as usize),
        )
        .map_err(&copy)?;
        s.memcpy_htod(hidden, &mut self.d_h.slice_mut(..hidden.len()))
            .map_err(&copy)?;
        s.memcpy_htod(&[u32::MAX], &mut self.d_bad).map_err(&copy)?;

        self.launch_kernels(li, n_live)?;

        let back = gpu_err("copying from the GPU");
        let s = &self.stream;
        let mut bad = [0u32];
        s.memcpy_dtoh(&self.d_bad, &mut bad).map_err(&back)?;
        s.synchronize().map_err(&back)?;
        if bad[0] != u32::MAX {
            let staged = self.staging.as_slice().map_err(&wait)?;
            let (position, column) = (bad[0] as usize / COLUMNS, bad[0] as usize % COLUMNS);
            let off = (position * COLUMNS + column) * engram_protocol::ROW_BYTES;
            let error = staged
                .get(off..off + engram_protocol::ROW_BYTES)
                .and_then(|r| r.try_into().ok())
                .and_then(|r| engram_protocol::row::check_row(r).err())
                .unwrap_or(RowError::Length { len: 0, rows: 1 });
            return Err(FusionError::Row {
                position,
                column,
                error,
            });
        }
        s.memcpy_dtoh(&self.d_h.slice(..hidden.len()), &mut self.host_h)
            .map_err(&back)?;
        s.synchronize().map_err(&back)?;
        let fused = self.host_h.as_slice().map_err(&back)?;
        hidden.copy_from_slice(&fused[..hidden.len()]);
        Ok(())
    }

    /// The three kernels over the `n_live` staged positions, on layer
    /// index `li`'s weights: dequantize the rows, project them to the
    /// key and value, gate them into the hidden streams.
    fn launch_kernels(&mut self, li: usize, n_live: u32) -> Result<(), FusionError> {
        let s = &self.stream;
        let launch = gpu_err("running a kernel");
        let cfg = LaunchConfig {
            grid_dim: (n_live * COLUMNS as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = s.launch_builder(&self.dequant);
        b.arg(&self.d_rows)
            .arg(&self.d_live)
            .arg(&n_live)
            .arg(&mut self.d_e)
            .arg(&mut self.d_bad);
        // SAFETY: the kernel reads n_live * 24 rows at live positions below n
        // (all inside d_rows) and writes n_live * 6144 values (inside d_e).
        unsafe { b.launch(cfg) }.map_err(&launch)?;

        let kv_len = self.shape.kv_len() as u32;
        let cfg = LaunchConfig {
            grid_dim: (kv_len.div_ceil(8), n_live, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = s.launch_builder(&self.matvec);
        b.arg(&self.wkv[li])
            .arg(&self.d_e)
            .arg(&mut self.d_kv)
            .arg(&kv_len);
        // SAFETY: reads kv_len rows of wkv and n_live inputs; writes n_live * kv_len values.
        unsafe { b.launch(cfg) }.map_err(&launch)?;

        let (hd, st) = (self.shape.hidden as u32, self.shape.streams as u32);
        let cfg = LaunchConfig {
            grid_dim: (st, n_live, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = s.launch_builder(&self.gates);
        b.arg(&mut self.d_h)
            .arg(&self.w[li])
            .arg(&self.d_kv)
            .arg(&self.d_live)
            .arg(&hd)
            .arg(&st);
        // SAFETY: each block reads and writes one stream of one live position,
        // all inside d_h (n positions), w, and d_kv (n_live positions).
        unsafe { b.launch(cfg) }.map_err(&launch)?;
        Ok(())
    }
}

impl Fusion for GpuFusion {
    fn name(&self) -> &'static str {
        "gpu"
    }

    fn shape(&self) -> FusionShape {
        self.shape
    }

    fn fuse(
        &mut self,
        layer: u32,
        rows: &[u8],
        live: &[bool],
        hidden: &mut [f32],
    ) -> Result<(), FusionError> {
        check_inputs(self.shape, layer, rows, live, hidden)?;
        let state = self.shape.state_len();
        for (c, live) in live.chunks(CHUNK).enumerate() {
            let first = c * CHUNK;
            let n = live.len();
            self.staging_rows(n)?.copy_from_slice(
                &rows[first * POSITION_ROW_BYTES..(first + n) * POSITION_ROW_BYTES],
            );
            let h = &mut hidden[first * state..(first + n) * state];
            self.fuse_staged(layer, live, h).map_err(|e| match e {
                FusionError::Row {
                    position,
                    column,
                    error,
                } => FusionError::Row {
                    position: position + first,
                    column,
                    error,
                },
                e => e,
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
