//! The smallest self-checking arx program: every rank contributes
//! `rank + 1 + i/1000` (exact in bf16-free f32) and checks the sum.
//!
//! ```sh
//! mpirun -n 2 target/release/examples/hello
//! ```

use std::process::ExitCode;

use arx::Arx;
use mpi::traits::*;

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let universe = mpi::initialize().expect("MPI initialises once");
    let world = universe.world();
    let rank = world.rank() as usize;
    let n = world.size() as usize;
    let result = (|| -> arx::Result<usize> {
        let mut arx = Arx::new(&world)?;
        let count = 1000;
        let input: Vec<f32> = (0..count)
            .map(|i| (rank + 1) as f32 + i as f32 / 1024.0)
            .collect();
        let mut output = vec![f32::NAN; count];
        arx.allreduce_host(&input, &mut output)?;
        // Small integers and multiples of 1/1024 sum exactly in f32.
        let wrong = (0..count)
            .filter(|&i| output[i] != (n * (n + 1) / 2) as f32 + (n * i) as f32 / 1024.0)
            .count();
        Ok(wrong)
    })();
    match result {
        Ok(0) => {
            println!("rank {rank}/{n}: allreduce of 1000 floats is correct");
            ExitCode::SUCCESS
        }
        Ok(w) => {
            eprintln!("rank {rank}/{n}: {w} wrong elements");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("rank {rank}/{n}: {e}");
            ExitCode::FAILURE
        }
    }
}
