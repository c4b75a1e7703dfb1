//! `modelforge`: parse flags, set up logging, run.

use modelforge::cli::Cmd;

/// mimalloc: per-thread free lists (glibc's arenas cost a fifth of a member's CPU under
/// heartbeat load), and freed memory is returned to the system after a short delay, so the
/// argon2 workers' 19 MiB blocks do not stay resident.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("the tokio runtime starts")
        .block_on(run())
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
