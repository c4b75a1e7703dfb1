//! `modelforge`: parse flags, set up logging, run.

use clap::Parser;
use modelforge::cli::Cli;
use modelforge::cli::Cmd;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() {
    modelforge::tls::install_provider();
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("MODELFORGE_LOG")
                .unwrap_or_else(|_| EnvFilter::new("info,openraft=warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
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
