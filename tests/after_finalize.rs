//! arx outside `MPI_Init` … `MPI_Finalize` (a `harness = false` test).
//!
//! Open MPI aborts a process that calls MPI before `MPI_Init` or after
//! `MPI_Finalize`. arx must instead return [`arx::Error::Mpi`] from
//! `Arx::new`, `Builder::build` and `Arx::barrier`, and drop an instance
//! after finalize without calling MPI. This program re-launches itself
//! under `mpirun -n 2` (MPI can be finalized only once per process, so it
//! cannot share a process with the other MPI tests); each rank checks, in
//! order: `Arx::new` before `MPI_Init`, a working instance, then after
//! `MPI_Finalize` (the rsmpi `Universe` dropped) `barrier()`, `Arx::new`,
//! a checked all-reduce on the instance (it needs no MPI) and dropping the
//! instance. A rank that aborts fails the run.

use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use arx::{verify, Arx, DeviceKind, Error};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

fn main() -> ExitCode {
    if std::env::var_os("ARX_TEST_CHILD").is_some() {
        match child() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("after_finalize: FAILED: {e}");
                ExitCode::FAILURE
            }
        }
    } else {
        parent()
    }
}

fn parent() -> ExitCode {
    let exe = std::env::current_exe().expect("the test binary knows its path");
    let mut cmd = Command::new("mpirun");
    cmd.args(["-n", "2", "--oversubscribe"]);
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        cmd.arg("--allow-run-as-root");
    }
    cmd.args(["--mca", "btl", "self,vader,tcp"]);
    cmd.arg(&exe)
        .env("ARX_TEST_CHILD", "1")
        .stdin(Stdio::null());
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!(
                "after_finalize: cannot start mpirun ({e}); install Open MPI (scripts/setup)"
            );
            return ExitCode::FAILURE;
        }
    };
    let start = Instant::now();
    let limit = Duration::from_secs(120);
    loop {
        match child.try_wait() {
            Ok(Some(s)) if s.success() => {
                println!("after_finalize: 2 ranks passed in {:.1?}", start.elapsed());
                return ExitCode::SUCCESS;
            }
            Ok(Some(s)) => {
                println!("after_finalize: FAILED ({s})");
                return ExitCode::FAILURE;
            }
            Ok(None) if start.elapsed() > limit => {
                let _ = child.kill();
                let _ = child.wait();
                println!("after_finalize: FAILED (killed after {limit:?})");
                return ExitCode::FAILURE;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => {
                println!("after_finalize: FAILED (waiting for mpirun: {e})");
                return ExitCode::FAILURE;
            }
        }
    }
}

/// Expects `Error::Mpi` whose detail says `says`.
fn refused(what: &str, r: arx::Result<()>, says: &str) -> Result<(), String> {
    match r {
        Err(Error::Mpi { detail, .. }) if detail.contains(says) => Ok(()),
        Err(e) => Err(format!(
            "{what}: expected an MPI error saying '{says}', got: {e}"
        )),
        Ok(()) => Err(format!("{what}: expected an error, got Ok")),
    }
}

fn child() -> Result<(), String> {
    // Before MPI_Init: the world handle exists, MPI does not.
    let r = Arx::new(&SimpleCommunicator::world()).map(|_| ());
    refused("Arx::new before MPI_Init", r, "not initialised")?;

    let universe = mpi::initialize().ok_or("MPI initialises once")?;
    let world = universe.world();
    let (rank, n) = (world.rank() as usize, world.size() as usize);
    let mut arx = Arx::builder()
        .device(DeviceKind::Host)
        .slot_bytes(64 << 10)
        .build(&world)
        .map_err(|e| format!("Arx::new: {e}"))?;
    // A working instance, checked against the reference.
    let input = verify::input::<f32>(0xf1a1, 1, rank, 1000);
    let want = verify::expected::<f32>(0xf1a1, 1, n, 1000);
    let mut out = vec![0f32; 1000];
    verify::poison(&mut out);
    arx.allreduce_host(&input, &mut out)
        .map_err(|e| format!("allreduce: {e}"))?;
    if verify::count_wrong(&out, &want) != 0 {
        return Err("wrong sum before finalize".into());
    }
    arx.barrier().map_err(|e| format!("barrier: {e}"))?;

    drop(universe); // MPI_Finalize
    if !mpi::environment::is_finalized() {
        return Err("dropping the Universe did not finalize MPI".into());
    }
    refused("barrier after MPI_Finalize", arx.barrier(), "finalized")?;
    refused(
        "Arx::new after MPI_Finalize",
        Arx::new(&world).map(|_| ()),
        "finalized",
    )?;
    refused(
        "Builder::build after MPI_Finalize",
        Arx::builder().build(&world).map(|_| ()),
        "finalized",
    )?;
    // Collectives make no MPI call: an instance made before keeps working
    // (docs/C.md says so), checked as before.
    let input = verify::input::<f32>(0xf1a1, 2, rank, 1000);
    let want = verify::expected::<f32>(0xf1a1, 2, n, 1000);
    verify::poison(&mut out);
    arx.allreduce_host(&input, &mut out)
        .map_err(|e| format!("allreduce after MPI_Finalize: {e}"))?;
    if verify::count_wrong(&out, &want) != 0 {
        return Err("wrong sum after finalize".into());
    }
    // Dropping makes no MPI call (the collective close is skipped with a
    // warning, the communicator is not freed).
    drop(arx);
    println!("after_finalize: rank {rank}: ok");
    Ok(())
}
