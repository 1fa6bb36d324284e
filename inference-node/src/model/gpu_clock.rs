//! The backbone stand-in on the GPU (`--features cuda`): each wait of the
//! loop's block schedule runs a busy kernel that occupies every SM until
//! the block's end (read from the GPU's global timer), so the model's
//! compute really holds the GPU while the rows travel. The host then
//! finishes the wait on the real clock (the launch and sync take a few
//! microseconds). Untested on hardware in this repository's CI.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use super::clock::{Clock, RealClock};
use crate::engram::FusionError;
use crate::engram::gpu::probe;

const BUSY: &str = r#"
extern "C" __global__ void engram_busy(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"#;

/// Below this a wait is left to the host clock (a launch costs microseconds).
const MIN_KERNEL: Duration = Duration::from_micros(20);

/// A clock whose waits keep the GPU busy.
pub struct GpuClock {
    real: RealClock,
    stream: Arc<CudaStream>,
    busy: CudaFunction,
    blocks: u32,
}

impl std::fmt::Debug for GpuClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuClock")
            .field("blocks", &self.blocks)
            .finish_non_exhaustive()
    }
}

impl GpuClock {
    /// Start on GPU `ordinal`.
    pub fn new(ordinal: usize) -> Result<Self, FusionError> {
        probe()?;
        catch_unwind(AssertUnwindSafe(|| Self::start(ordinal))).unwrap_or_else(|_| {
            Err(FusionError::Gpu(
                "CUDA failed to start the backbone kernel".into(),
            ))
        })
    }

    fn start(ordinal: usize) -> Result<Self, FusionError> {
        let e = |what: &'static str| {
            move |x: cudarc::driver::DriverError| FusionError::Gpu(format!("{what}: {x}"))
        };
        let ctx = CudaContext::new(ordinal).map_err(e("opening the GPU"))?;
        let stream = ctx.new_stream().map_err(e("creating a stream"))?;
        let ptx = cudarc::nvrtc::compile_ptx(BUSY)
            .map_err(|x| FusionError::Gpu(format!("compiling the backbone kernel: {x}")))?;
        let module = ctx
            .load_module(ptx)
            .map_err(e("loading the backbone kernel"))?;
        let busy = module
            .load_function("engram_busy")
            .map_err(e("engram_busy"))?;
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(e("reading the SM count"))?;
        Ok(Self {
            real: RealClock::start(),
            stream,
            busy,
            blocks: u32::try_from(sms).unwrap_or(1).max(1),
        })
    }

    /// The real clock under it.
    pub fn real(&self) -> RealClock {
        self.real
    }
}

impl Clock for GpuClock {
    fn now(&self) -> Duration {
        self.real.now()
    }

    fn sleep_until(&self, t: Duration) {
        let left = t.saturating_sub(self.now());
        if left > MIN_KERNEL {
            let ns = (left - MIN_KERNEL / 2).as_nanos() as u64;
            let cfg = LaunchConfig {
                grid_dim: (self.blocks, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = self.stream.launch_builder(&self.busy);
            b.arg(&ns);
            // SAFETY: the kernel takes one u64 by value and touches no memory.
            let launched = unsafe { b.launch(cfg) };
            if launched.is_err() || self.stream.synchronize().is_err() {
                tracing::warn!("the backbone kernel failed; waiting on the host");
            }
        }
        self.real.sleep_until(t);
    }
}
