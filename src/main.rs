//! `modelforge`: parse flags, set up logging, run.

use modelforge::cli::Cmd;

fn main() {
    // Before any thread exists: the allocator's settings hold for every arena.
    tune_allocator();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("the tokio runtime starts")
        .block_on(run())
}

/// glibc's malloc raises its mmap threshold to the size of each large block freed (up to
/// 32 MiB), so after the first argon2 hash (19 MiB at the default parameters) the next ones
/// come from the hash workers' arenas, and freed arena memory mostly stays resident: a member
/// kept about 600 MiB after filling its credential pool (tests/resources.rs). A fixed
/// threshold keeps blocks of 1 MiB and more in their own mappings, returned to the system
/// when freed; the arenas are capped at two a core.
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        // SAFETY: mallopt only sets allocator parameters; called before any other thread runs.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
            libc::mallopt(libc::M_ARENA_MAX, (2 * cores) as libc::c_int);
        }
    }
}

async fn run() {
    modelforge::tls::install_provider();
    let cli = modelforge::config::parse();
    modelforge::cli::init_logs(cli.log_format);
    let result = match cli.command {
        Cmd::Admin(args) => std::process::exit(modelforge::admin_cli::run(*args).await),
        Cmd::Serve(args) => match modelforge::cli::private_files()
            .and_then(|()| (*args).into_config())
        {
            Ok(cfg) => modelforge::server::serve(cfg, shutdown_signal()).await,
            Err(e) => Err(e),
        },
        Cmd::Argon2Bench(args) => modelforge::cli::argon2_bench(&args),
        Cmd::Restore(args) => {
            modelforge::cli::private_files().and_then(|()| modelforge::cli::restore(&args))
        }
        Cmd::Config(modelforge::cli::ConfigCmd::Validate(_)) => {
            match modelforge::config::describe(std::env::args_os().collect()) {
                Ok(text) => {
                    print!("{text}");
                    Ok(())
                }
                Err(e) => {
                    eprintln!("modelforge: {e:#}");
                    std::process::exit(2);
                }
            }
        }
        Cmd::Completion { shell } => {
            let mut cmd = <modelforge::cli::Cli as clap::CommandFactory>::command();
            let mut script = vec![];
            clap_complete::generate(shell, &mut cmd, "modelforge", &mut script);
            // A closed pipe (`| head`) is not an error worth a panic.
            let _ = std::io::Write::write_all(&mut std::io::stdout(), &script);
            Ok(())
        }
        Cmd::Cluster(modelforge::cli::ClusterCmd::InitCa { out }) => modelforge::tls::init_ca(&out)
            .map(|()| {
                println!(
                    "wrote {0}/ca.pem and {0}/ca.key (keep ca.key private); start each member with --tls-ca {0}/ca.pem --tls-ca-key {0}/ca.key",
                    out.display()
                );
            }),
    };
    if let Err(e) = result {
        eprintln!("modelforge: {e:#}");
        std::process::exit(1);
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::SignalKind;
    use tokio::signal::unix::signal;
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("install SIGINT handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
